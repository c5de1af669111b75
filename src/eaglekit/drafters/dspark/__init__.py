"""DSpark: DFlash's backbone (``drafters/dflash/``) with a Markov head drafting left to right. ``family.py`` extends
DFlash's family; ``model.py`` the drafter, ``checkpoint.py`` its form on disk, ``proposer.py`` its drafting."""
