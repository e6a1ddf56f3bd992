"""The job supervisor: `dlmaster --job-config job.yaml` runs a whole job. It
reads job.yaml (`jobconfig.py`), starts the master service as a child process
(`supervised.py`) and the nodes on a platform (`platform/`), serves the Job
service for `dlmaster status` and `dlmaster scale`, talks to the brain
(`brain_link.py`) and shows the job in the terminal (`display.py`).

Everything here runs in the supervisor process, except `control.py`: the
`dlmaster status` / `dlmaster scale` commands, a short-lived client process of
a running supervisor. The master service (`dlfleet.master.service`) never
imports this package. `jobconfig.py` and `crd.py` (job.yaml as a Kubernetes
resource) are read by the DLFleetJob controller too (`dlfleet.master.operator`,
a process of its own), which imports nothing else from here."""
