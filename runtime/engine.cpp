#include "runtime/engine.h"
