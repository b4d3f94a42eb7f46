"""The steps, above the stages and below the faces: workflow.py (one function per step), preflight.py (the checks a
command runs before it loads a model or trains) and forecast.py (a step's estimate of time and disk before it
starts). The CLI (`layerscope.commands`) and the app (`layerscope.ui`) both go through them."""
