"""The DLFleetJob controller: `dlmaster operator`, a process of its own
(usually a Deployment; deploy/operator). For each DLFleetJob it keeps the
objects that run the job's supervisor (`plan.py` decides what should exist,
pure; `controller.py` lists, creates, deletes and writes the resource's
status through the Kubernetes API).

It reads the job's configuration (`dlfleet.master.job.jobconfig`) and the
resource made from it (`dlfleet.master.job.crd`), and the API package; it
imports neither the supervisor's runner nor its platforms, nor the master
service: it meets them only as the Pods it starts. The supervisor never
imports this package (its side of the resource is
`dlfleet.master.job.platform.resource_link`)."""
