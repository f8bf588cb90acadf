"""Model architectures: each module defines one family as a ``CausalLM`` (interfaces.model).

``llama``: Llama 2/3, SmolLM, Mistral and Qwen2. The loader reaches them through the
``powertrain_model_architectures`` hook (``builtin/models.py``), never by import here,
so importing this package stays cheap.
"""
