"""`splitserve bench serve`: a load generator for any OpenAI-compatible server or
splitserve's gRPC API, in the spirit of `vllm bench serve`.

One job per module: `datasets` builds the sessions to send, `arrivals` when to
send them, `backends` how (one timed request each), `driver` runs a load and
`burst` the interference scenario, `metrics` turns records into figures,
`results` is the JSON shape (what other harnesses import), `report` prints,
`plots` draws, `main` wires the flags to all of it.
"""
