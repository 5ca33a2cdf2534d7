#include "train/loss.h"
