"""The overfitting guard: held-out τ falling while the held-out loss keeps falling.

The loss a drafter trains on and the acceptance it is judged by part ways with more epochs (DeepSpec#84: τ peaked at
4.6 epochs and lost 4.9 % by epoch 10 while the loss still fell). best/ already keeps the drafter of the highest
held-out τ; this says when the run has gone past it, and with ``train.early_stop_patience`` ends the run there.
"""

from __future__ import annotations

from dataclasses import dataclass

WARN_AFTER = 3  # evaluations in a row of falling τ under falling loss before the run says so (no patience set)


@dataclass
class TauWatch:
    patience: int | None  # stop after this many evaluations in a row of falling τ and falling loss; None: never
    streak: int = 0
    last: tuple[float, float] | None = None  # (τ, loss) of the previous evaluation
    warned: bool = False

    def update(self, tau: float, loss: float) -> tuple[str | None, bool]:
        """Take one held-out evaluation; return (a warning to print or None, whether to stop now)."""
        if self.last is not None and tau < self.last[0] and loss < self.last[1]:
            self.streak += 1
        else:
            self.streak, self.warned = 0, False
        self.last = (tau, loss)
        limit = self.patience or WARN_AFTER
        if self.streak < limit:
            return None, False
        stop = self.patience is not None
        if self.warned and not stop:
            return None, False
        self.warned = True
        message = (
            f"held-out τ has fallen for {self.streak} evaluations in a row while the held-out loss fell: the drafter "
            "is fitting the loss past what acceptance gains (best/ keeps the highest τ)"
        )
        message += "; stopping (train.early_stop_patience)" if stop else "; set train.early_stop_patience to stop here"
        return message, stop
