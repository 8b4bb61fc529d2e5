"""Short texts in the layout of WikiText-103's wiki.test.tokens: blank lines are " ", headings " = Title = ",
and every token, including punctuation and the @-@ / @,@ / @.@ joiners, is separated by single spaces."""

from __future__ import annotations

SHORT_WIKITEXT = (
    " \n"
    " = Robert Boulter = \n"
    " \n"
    " Robert Boulter is an English film , television and theatre actor . \n"
)

LONG_WIKITEXT = (
    " \n"
    " = Tower Bridge = \n"
    " \n"
    " Tower Bridge is a combined bascule and suspension bridge in London , built between 1886 and 1894 . "
    "The bridge crosses the River Thames close to the Tower of London and has become an iconic symbol of "
    "London . \n"
    " \n"
    " = = Design = = \n"
    " \n"
    " The bridge is 800 feet ( 240 m ) in length and consists of two 213 @-@ foot ( 65 m ) bridge towers "
    "connected at the upper level by two horizontal walkways . Its 1 @,@ 000 @-@ tonne bascules were "
    "raised 6 @,@ 160 times in 1894 ; the engines ran on steam until 1976 . \n"
    " \n"
    " = = = Reception = = = \n"
    " \n"
    " The architect 's design was criticised by \" The Builder \" , which called it \" the most monstrous and "
    "preposterous architectural sham \" . The bridge 's colours were changed in 1977 for the Queen 's "
    "Silver Jubilee . \n"
)
