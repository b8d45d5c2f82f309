"""Hidden-state capture: one writer shared by every engine, and SGLang's forward hook."""
