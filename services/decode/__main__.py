"""`python -m services.decode`: one decode worker, configured from LLMD_* environment variables."""

from services.decode.worker import DecodeWorker
from services.runtime.worker import main

main(DecodeWorker)
