"""Models of the card and the workload that the run stage and the submission read, for the final
round (two cards under load): the model's shape and weights per rank and vLLM 0.18.1's hybrid page
math (shape), the KV cache a server will report and how many of a tier's requests stay resident
(capacity), the DCU time model's components and a scheduler step's time from them (costs), vLLM v1's
scheduler stepped iteration by iteration (sched), and a tier served under the finals' client,
ranked over a configuration space (finals). Pure computation: it reads configs/ through the core
and the contest's rounds, never a run folder, and writes nothing. Rests on the core and
`forge.contest`; `forge.run` (plan, predict --round final, sweep --round final) reads it."""
