"""Run stage: serving the built artifact and measuring it the way the contest does.

Owns starting and stopping a server (serve), the three benchmark tiers and their request shapes
(bench, synth), run folders (runs), scoring (score), comparing and sweeping profiles (compare),
accuracy and the DCU prediction (predict). Imports the core,
`contest` (the rules and serve profiles) and `build` (provenance for reports); never `lab`."""
