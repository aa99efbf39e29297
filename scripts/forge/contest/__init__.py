"""The contest, as both stages read it: the rules, the organizers' start script and benchmark client,
the tiers, formula and baselines of configs/contest.yaml and the one check every server command goes
through (rules), the rounds (the preliminary and the final: rounds, with the visible cards' check in
cards), and the serve profiles checked against them and rendered into the server
command (profiles). Rests on the core alone; the build stage, the run stage and everything above read it."""
