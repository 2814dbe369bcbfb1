"""`tierkv bench` and `tierkv eval` behind the CLI: the restore pipeline on synthetic KV
(pipeline.py), time to first token through real engines (engines.py), what each codec does to a
model's output (eval.py), and the fresh process vLLM runs in for both (engine_process.py, child.py).
"""
