"""Code that runs inside vLLM's own Python, not eaglekit's: its folder goes on vLLM's PYTHONPATH.

Modules here import only vLLM, torch and the standard library (the vLLM environment has no eaglekit), and
are imported by vLLM by their top-level name (``kv_connector_module_path``), so this ``__init__`` is never
part of that import. ``eaglekit.serving.vllm_features.plugin_dir()`` is the folder to put on the path.
"""
