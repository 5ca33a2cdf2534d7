#include "train/optimizer.h"
