"""Engine adapters: what an inference engine calls to reuse K/V through kvstore.

``transformers.py`` (Hugging Face causal LMs, needs the ``kvstore[transformers]``
extra), ``vllm.py`` (a vLLM v1 KV connector; its key and block mapping lives in
``vllm_mapping.py`` so it is testable without vLLM; ``vllm_run.py`` runs a real
vLLM with it for tests and benchmarks), ``lmcache.py`` (an L2 adapter for
LMCache's multiprocess server), ``sglang.py`` (a HiCache storage backend).
Adapters use only the public client API and ``kvstore.keys``; the service's
vLLM-format KV events for routers are ``kvstore.service.events``.
"""
