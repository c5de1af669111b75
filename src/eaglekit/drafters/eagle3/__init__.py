"""EAGLE-3: one decoder layer (Llama or DeepSeek's multi-head latent attention) drafting a chain, trained with the
training-time test. ``family.py`` is what the pipeline asks of it (``llama.py``, ``mla.py``: the two layer kinds'
entries in the registry); ``model.py`` + ``mla_layer.py`` the drafter, ``checkpoint.py`` its forms on disk,
``objective.py`` + ``ttt.py`` (with ``attention.py``, ``head_loss.py``, ``fused.py``) its objective, ``init.py`` the
drafter a run starts from, ``memory.py`` one step's GPU memory, ``proposer.py`` its drafting for
``speculative/decode.generate``, ``diagnosis.py`` why a served drafter accepts less than offline."""
