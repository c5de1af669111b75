"""DFlash2: DFlash (``drafters/dflash/``) with a grouped dynamic convolution around every sublayer and a path
selector over each slot's top K. ``family.py`` is what the pipeline asks of it; ``model.py`` the drafter,
``checkpoint.py`` its form on disk (vLLM's ``DFlash2DraftModel``), ``proposer.py`` its drafting for
``speculative/decode.generate``; the objective, memory model and diagnosis are DFlash's."""
