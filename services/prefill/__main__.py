"""`python -m services.prefill`: one prefill worker, configured from LLMD_* environment variables."""

from services.prefill.worker import PrefillWorker
from services.runtime.worker import main

main(PrefillWorker)
