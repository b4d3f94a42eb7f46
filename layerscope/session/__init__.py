"""Analysis sessions: what a user looked at, saved on disk and shareable, never pickled.

A session is one zip archive of JSON and safetensors (no code can run from it), kept in the store as
``<store>/sessions/<id>/session.zip`` and downloaded/uploaded as the same file. Loading validates every
field and tensor against one schema (types, ranges, sizes, ids matched in full; every field a page reads)
and refuses anything else with a `SessionError`; saving runs the same checks on the archive it is about to
write, so a session that saves always loads again, and an imported one always opens.

    model.py     the Session dataclass and its small methods
    schema.py    the schema language, the limits and the schemas of session.json
    check.py     validation: the schema plus the rules across fields and tensors; how a refusal reads
    archive.py   the zip archive: write, read, the drafts an exported archive may carry
    storage.py   save, load, list and delete sessions in the store
    share.py     export (optionally with drafts) and import into a store

Import each name from its module (`from layerscope.session import storage`, then `storage.load(...)`).
"""
