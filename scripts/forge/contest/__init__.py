"""The contest, as both stages read it: the rules, the organizers' start script and benchmark client,
the tiers, formula and baselines of configs/contest.yaml and the one check every server command goes
through (rules), and the serve profiles checked against them and rendered into the server command
(profiles). Rests on the core alone; the build stage, the run stage and everything above read it."""
