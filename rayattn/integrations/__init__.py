"""Everything rayattn does with vLLM's and Ray's internals, one surface a module:

  * vllm_engine     vLLM's engine arguments, config objects and the error of a dead engine
  * vllm_openai     vLLM's OpenAI serving layer over an engine (what `vllm serve` builds)
  * vllm_renderer   vLLM's engine-free renderer (the router's prompt rendering)
  * vllm_hashing    vLLM's prefix-cache block hashing and the extra keys it hashes
  * vllm_kv_events  where vLLM's DP ranks publish their KV events
  * vllm_backends   attention-backend facts read from the installed vLLM's classes
  * vllm_parsers    the installed vLLM's reasoning and tool-call parser names
  * devices         GPUs an engine's workers run on (a vLLM worker extension, NVML)
  * serve_private   Ray Serve's private API (its controller, deploy, HAProxy settings)
  * ray_private     Ray core's private API
  * patches         every run-time patch of a library, registered and logged where applied

Where the supported vLLM and Ray versions differ is rayattn/compat.py's alone; these modules
ask it. The private APIs they use are pinned by tests/unit/integrations/: a test fails,
naming the API, when the installed library changes one.

Module-level imports are standard library and rayattn only: vLLM's worker processes import
devices.py (the worker extension), Ray workers patches.py (a setup hook), and `rayattn check`
must not need vLLM or Ray.
"""
