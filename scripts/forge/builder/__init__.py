"""Build stage: from the pinned vLLM source to the artifacts we ship.

Owns fetching and verifying the source (fetch, with pip's index in pipindex), the bases a series
applies to (bases), the patched tree build/vllm with its kernel overlay and one commit per patch
(tree, patches), the offline check (offline, cmakelang), the vendor build's behaviour (setupprobe,
basecheck), the wheel, the container image and its rehearsal (image), the kernels' compile checks
(kernels), the full-compile rehearsal (rehearsal) and the contest container's toolchain check
(toolchain, with the Python and ld.lld it finds in toolchainfind). Rests on the core, `contest`
(the rules the patch linter checks) and `recipe` (the series' files, provenance records); never
imports `run`, `ship` or `lab`."""
