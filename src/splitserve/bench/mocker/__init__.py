"""Mocker workers: the real worker, with the model's forward pass replaced by its modelled time.

A mocker is `workers/server.py`'s `start_worker` around a real `Engine` (its
scheduler, block pool, prefix cache, KV events, engine loop, gRPC services,
handshake, stats, cancel and drain), whose runner (`runner.py`) does not run
the model: it waits the time the planner's cost model gives the step (a profile
measured here, or a deployment's roofline: plan/costs.py) and emits a checkable
token sequence (`tokens.py`). So the router, its streams, health polls and
prefix index stand in front of what they would meet in production, and hundreds
of mockers run in one process (`fleet.py`), each on its own ports.

The KV cache is real but small: a one-layer, one-head model's, so a prefill
mocker sends real bytes over the real transport to the decode mocker that
reserved the blocks, scaled down from the modelled model's KV by a factor the
fleet states (`Fleet.kv_scale`); the link's time for the full bytes is not added.
"""
