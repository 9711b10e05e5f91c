"""Worker scripts the tests run under real launchers (torchrun, horovodrun, deepspeed)."""
