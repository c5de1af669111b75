"""DFlash: a block drafter (a block of mask slots drafted in one non-causal pass over the target's context), and the
block objective DSpark shares. ``family.py`` is what the pipeline asks of it; ``model.py`` the drafter,
``checkpoint.py`` its form on disk (vLLM's), ``objective.py`` the anchored-block objective, ``memory.py`` one step's
GPU memory, ``proposer.py`` its drafting for ``speculative/decode.generate``, ``diagnosis.py`` why a served drafter
accepts less than offline."""
