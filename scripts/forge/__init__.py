"""dcu-forge: build, serve, benchmark and score a patched vLLM 0.18.1 for Qwen3.5-27B on Hygon DCU.

The tool in layers, lowest first; a module imports its own layer and those below, never one above
(docs/architecture.md): the core (the modules here: config, proc, paths, errors, ui, options,
hashing, tunedtable); `contest` and `recipe` (what both stages read); `builder` (the build stage);
`run` (the run stage); `ship` (the submission, the export and their documents); `lab` (the GPU
stand-in harness); on top the commands (cli, __main__, devenv, testrun)."""

__version__ = "0.1.0"
