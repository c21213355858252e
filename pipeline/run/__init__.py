"""Running a job: planning (``plan``), the local loop (``local``), the Ray executor (``ray``), the driver (``control``)."""

from .control import Aborted, BarRefresher, RunSummary, run_job
from .local import GenerationError, generate_samples, load_job_model
from .plan import check_output_dir, fingerprint, generate_params, job_fingerprint, plan_samples

__all__ = ["Aborted", "BarRefresher", "GenerationError", "RunSummary", "check_output_dir", "fingerprint",
           "generate_params", "generate_samples", "job_fingerprint", "load_job_model", "plan_samples", "run_job"]
