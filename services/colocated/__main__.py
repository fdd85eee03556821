"""`python -m services.colocated`: one colocated worker, configured from LLMD_* environment variables."""

from services.colocated.worker import ColocatedWorker
from services.runtime.worker import main

main(ColocatedWorker)
