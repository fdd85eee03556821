"""`python -m services.colocated`: one colocated worker, configured from LLMD_* environment variables."""

from services.colocated.worker import ColocatedWorker
from services.worker_base import main

main(ColocatedWorker)
