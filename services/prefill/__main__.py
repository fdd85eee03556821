"""`python -m services.prefill`: one prefill worker, configured from LLMD_* environment variables."""

from services.prefill.worker import PrefillWorker
from services.worker_base import main

main(PrefillWorker)
