"""The built-in game guessnumber (clemcore game folder: clemgame.json, master.py, in/)."""
