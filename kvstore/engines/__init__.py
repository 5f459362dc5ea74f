"""Engine adapters: what an inference engine calls to reuse K/V through kvstore.

``transformers.py`` (Hugging Face causal LMs, needs the ``kvstore[transformers]``
extra), ``vllm.py`` (a vLLM v1 KV connector; its key and block mapping lives in
``vllm_mapping.py`` so it is testable without vLLM), ``events.py`` (vLLM-format
KV events for cache-aware routers). Adapters use only the public client API
and ``kvstore.keys``.
"""
