"""The shared base every package stands on: typed recipe configs and user errors, the one model
loader (which honours a hybrid-attention spec saved in the config), tiny models built in code and
the built-in offline corpus."""
