"""The device's pipeline, what a command goes through once the tick thread takes it
(docs/architecture.md, "Device"): its admission (admission.py: the mutation protocol every
operation kind shares), and for an input its execution after that (execution.py: lease, memory,
engine, output, completion; the transfers' payloads in transfers.py, the memory it retains in
retention.py), the prompt it is generated from (prompt.py) and the images it carries (images.py)."""
