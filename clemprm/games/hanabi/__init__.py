"""The built-in game hanabi (clemcore game folder: clemgame.json, master.py, in/).

``rules`` (the game), ``bot`` (the rule-based player and the move rating), ``protocol`` (prompts, answers, the
deduction score), ``rewards`` (per-turn scores of an engine episode), ``states`` (the prompt set of game states).
"""
