"""Drafts on disk and for the engines, under the one name every caller imports (`layerscope.draft.export`).

Nothing is defined here; each idea has its own module:

    layerscope/draft/checkpoint.py      a draft directory: its four files, save_draft (whole or not at all,
                                        staged), load_draft (no pickle, checked against the target), read_meta /
                                        read_config / read_layers_record, and draft_layers, the rule that
                                        every file's record of the layers names one set
    layerscope/draft/engine_export.py   the folder each engine trains, serves and benchmarks from:
                                        export_draft, export_zip, engine_verdict, target_name / TargetName,
                                        the SpecForge and speculators files
    layerscope/draft/commands_md.py     COMMANDS.md in every export folder, and ENGINE_READS
    layerscope/draft/check.py           check_draft: the layers each engine would read from a directory
    layerscope/engines.py               the engines' layer-id conventions and refusals those modules apply

A name is defined once, in its module; to replace one in a test (monkeypatch), replace it there
(layerscope.draft.checkpoint.swap_into_place), not here.
"""

from __future__ import annotations

from layerscope.draft.check import check_draft, verifier_problem
from layerscope.draft.checkpoint import (
                                         FILES,
                                         FORMAT,
                                         MAX_JSON_BYTES,
                                         STAGING,
                                         TORCH_DTYPES,
                                         check_fits,
                                         draft_layers,
                                         draft_tensors,
                                         engine_config,
                                         layers_record,
                                         load_draft,
                                         read_config,
                                         read_layers_record,
                                         read_meta,
                                         recorded_facts,
                                         recorded_facts_of,
                                         rescue,
                                         save_draft,
                                         serving_notes,
                                         staged,
                                         swap_into_place,
                                         write_draft,
)
from layerscope.draft.commands_md import ENGINE_READS, commands_md
from layerscope.draft.engine_export import (
                                         SPECFORGE_YAML,
                                         TargetName,
                                         engine_verdict,
                                         export_draft,
                                         export_zip,
                                         model_folder,
                                         speculators_config,
                                         target_name,
                                         trained_target,
                                         write_specforge,
                                         write_speculators,
)

__all__ = [
    # checkpoint
    "FORMAT", "FILES", "STAGING", "MAX_JSON_BYTES", "TORCH_DTYPES", "serving_notes", "layers_record",
    "engine_config", "draft_tensors", "write_draft", "save_draft", "rescue", "staged", "swap_into_place",
    "read_config", "read_meta", "read_layers_record", "recorded_facts", "load_draft", "check_fits",
    "draft_layers", "recorded_facts_of",
    # engine_export
    "export_draft", "trained_target", "engine_verdict", "export_zip", "TargetName", "model_folder",
    "target_name", "write_specforge", "SPECFORGE_YAML", "speculators_config", "write_speculators",
    # commands_md
    "ENGINE_READS", "commands_md",
    # check
    "check_draft", "verifier_problem",
]
