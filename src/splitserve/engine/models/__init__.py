"""Model families: one module per architecture declaring its decoder once (`declare.py`'s
`Architecture`), composed from the pieces families share (`parts.py`), found by the
checkpoint's own name through `registry.py`."""
