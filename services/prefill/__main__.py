"""`python -m services.prefill`: one prefill worker, configured from LLMD_* environment variables."""

from services.runtime.omp_wait import spin_briefly

spin_briefly()  # before torch loads: see the module

from services.prefill.worker import PrefillWorker  # noqa: E402
from services.runtime.worker import main  # noqa: E402

main(PrefillWorker)
