// dsv4-view: see gui/widgets/view_main.h for the command line.
#include "gui/widgets/view_main.h"

int main(int argc, char** argv) {
  return dsv4::gui::view_main(argc, argv);
}
