"""Speculative decoding on the decode path: drafts proposed from a sequence's own tokens
(`ngram.py`, prompt lookup), verified by the target model in the step that would have
produced one token (engine/model_runner.py runs a draft's positions as extra rows of the
decode step), accepted as the longest prefix the target itself would have drawn
(`verify.py`), and kept on only where the measured acceptance pays for the extra rows
(`policy.py`). `speculator.py` joins them to the engine's step."""
