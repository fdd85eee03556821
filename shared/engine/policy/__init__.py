"""The step policy (policy.py) and its parts: the prompt order, the step budget's cost model, the
ledger of late gaps and the decode pacer. docs/scheduling.md is its one page of explanation."""

from shared.engine.policy.policy import Lend, StepPolicy

__all__ = ["Lend", "StepPolicy"]
