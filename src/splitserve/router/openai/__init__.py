"""The OpenAI-compatible HTTP door: an OpenAI body in, the public `GenerateRequest` through the
gRPC service's admission, OpenAI's answer out. Read by folder name:

- door.py: the aiohttp app, its routes and the API key's middleware; streaming.py: a streamed
  answer's server-sent events; errors.py: a failure's HTTP status and error body;
- generation.py: what the door uses of the gRPC service (`Generation`, a protocol);
- json_value.py: the type of the JSON the door writes;
- json_body.py: the body's bytes -> a JSON value; translate.py: the body -> the request to run;
- fields.py: one field's checks; messages.py, tools.py, response_format.py: the larger fields;
- choices.py, logprobs.py, tool_calls.py, tool_formats.py: the answer's choices.
"""
