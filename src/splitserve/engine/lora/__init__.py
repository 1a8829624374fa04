"""LoRA adapters on one base model (issue 46): `adapter.py` reads a PEFT directory into the
model's fused slots and names it by its content; `rows.py` applies each adapter's update to its
own rows of a step and roots its block hashes in its id."""
