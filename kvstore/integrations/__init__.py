"""Engine integrations: each module plugs kvstore into one inference stack through its own
extension point, imports that stack lazily, and talks to the daemon through the public clients.

| module | engine | extension point |
| --- | --- | --- |
| ``transformers.py`` | Hugging Face transformers 5 | ``wrap(model, client)``: a ``generate`` that reuses stored prefixes |
| ``sglang.py`` | SGLang HiCache | an L3 ``HiCacheStorage`` backend loaded by module path |
| ``vllm.py`` | vLLM v1 | a ``KVConnectorBase_V1`` loaded by ``kv_connector_module_path`` |
"""
