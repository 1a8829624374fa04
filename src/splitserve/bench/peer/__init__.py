"""`splitserve bench peer`: vLLM's CPU build and splitserve, same model, same load, one run.

hf_export.py writes the GGUF as the HF directory vLLM loads, vllm_env.py builds
vLLM's own venv, servers.py starts and stops each system, report.py turns the
load generator's JSON into the ratio table, main.py is the command.
"""
