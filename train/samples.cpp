#include "train/samples.h"
