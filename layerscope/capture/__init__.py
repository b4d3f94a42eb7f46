"""Capture: run the target over a prompt set and store every layer's hidden states (`run`), and the stored format (`format`)."""
