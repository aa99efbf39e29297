"""Run stage: serving the built artifact and measuring it the way the contest does.

Owns serve profiles and the contest's rules (profiles, contest), starting and stopping a server
(serve), the three benchmark tiers and their request shapes (bench, synth), run folders (runs),
scoring (score), comparing and sweeping profiles (compare), accuracy, the generated documents
(report) and the DCU prediction (predict). Imports the core and `build` (provenance for reports);
never `lab`."""
