"""P-EAGLE (parallel EAGLE-3): EAGLE-3's layer drafting all K tokens in one forward pass (``family.py`` says how its
parts fit, and how the peers train it)."""
