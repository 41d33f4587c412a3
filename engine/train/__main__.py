"""`python -m engine.train CONFIG.yaml [key=value ...]`: pretraining, the engine alone."""

import sys

from engine.train.pretrain import main

sys.exit(main())
