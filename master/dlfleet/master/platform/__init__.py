"""Where a job's nodes run: `local` (dlworker processes on this machine)."""
