import CLibevent
import CCurl
