"""Run stage: serving the built artifact and measuring it the way the contest does.

Owns starting and stopping a server (serve), the three benchmark tiers and their request shapes
(bench, synth), the organizers' results imported as a run (imported), run folders and their archives
(runs, results, archive), scoring (score, score_doc), comparing and sweeping profiles (compare),
accuracy, the DCU prediction (timemodel, predict, predict_calibration) and the calibration on the
card (calibrate, calibration, calibration_docs, calibrate_report). Rests on the core, `contest`,
`recipe` and `builder` (it serves and records what was built); never imports `ship` or `lab`."""
