"""What ships to the contest, made from both a built tree and measured runs: the repository a team
pushes with its pre-flight (submission), the patched tree and wheel packed for a scoring repository
(export), and the documents they carry: env-vars, optimization plan and submission README (report),
ENVIRONMENT.md and OPTIMIZATION.md (contest_docs), the runs and the card's route they quote
(submission_runs, card_route) and their prose helpers (submission_text). Rests on the core, `contest`,
`recipe`, the build stage and the run stage; nothing below imports it; `lab` may."""
