#include "train/grad_tree.h"
